"""The mmworker worker: config, feature cache, engine, Kafka loop and CLI.

Kept import-light: heavy modules (vLLM, kafka) are imported by the modules that use them.
"""

__version__ = "0.1.0"
