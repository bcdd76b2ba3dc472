"""rl4bit: RL post-training on 4-bit numerics."""
__version__ = "0.1.0"
