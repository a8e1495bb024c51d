"""tiermem.pool"""
