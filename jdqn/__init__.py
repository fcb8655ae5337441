"""jdqn: a JAX/XLA trainer for a branching distributional deep Q-network that trades futures."""

__version__ = "0.1.0"
