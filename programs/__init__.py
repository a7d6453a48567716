"""Programs that run beside the server and talk to it over its wire or its HTTP API.

``arstream client`` (client.py, with the JSON it sends in messages.py), ``arstream bench serve`` (bench.py),
``arstream bench gpu-check`` (gpu_check.py) and ``arstream drain`` (drain.py). They import the server's
shared pieces (app/wire.py's frame format, app/video.py's decoder) but the server never imports them
(tests/test_layering.py holds that).
"""
