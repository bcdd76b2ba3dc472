"""rl4bit.trainer"""
