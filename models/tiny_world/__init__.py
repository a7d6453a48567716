"""tiny-world: the small causal video-diffusion world model ARStream trains and ships.

``world`` renders the procedural ground truth, ``model`` is the network,
``sampling`` the few-step chunk sampler, ``pipeline`` the runner contract,
``train`` / ``evaluate`` / ``bench`` the ``arstream`` subcommands.
"""
