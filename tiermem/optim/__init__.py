"""tiermem.optim"""
