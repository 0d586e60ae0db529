"""Media → model-ready pixels for Qwen2.5-VL: fetch, sniff, decode, sample, resize, count tokens.

Depends on Pillow, PyAV and numpy only: no Kafka, no vLLM, no torch, so it can run in worker
processes and in producers that want to pre-validate media.
"""
