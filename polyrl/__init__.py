"""polyrl: reinforcement-learning post-training for LLMs and flow-matching image models, one trainer core."""

__version__ = "0.1.0"
