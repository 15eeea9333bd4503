"""The simulated engine: vLLM's (or llama-server's) HTTP API with timing from the decode model of seed 002.

It lets the pool run, be tested and be benchmarked without a GPU or model
weights. No model runs here: text is synthetic filler and every response says
it came from a simulated engine.
"""
