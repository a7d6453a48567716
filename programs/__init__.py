"""Programs that run beside the server and talk to it over its wire or its HTTP API.

``arstream client`` (client.py, over the client library client_lib.py), ``arstream bench serve`` (bench.py),
``arstream bench gpu-check`` (gpu_check.py), ``arstream drain`` (drain.py), and lossy_link.py (two network
namespaces joined by a relay that delays and drops packets, to measure the server over a bad network). They
import the server's shared pieces (app/wire.py's frame format, app/video.py's decoder) but the server never imports them
(tests/project/test_layering.py holds that).
"""
