"""deltaloop: RL post-training pipeline for language models (command-line entry point package)."""

__version__ = "0.1.0"
