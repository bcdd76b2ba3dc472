"""rl4bit.sampler"""
