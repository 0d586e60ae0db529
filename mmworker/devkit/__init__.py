"""Development tooling: the random-weight test model, the embedded broker, the demo, sample media
and the CPU-torch repair. None of it runs in production; the worker's runtime modules never import
this package (a unit test checks), and the CLI reaches it only from its development commands.
"""
