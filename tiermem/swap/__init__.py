"""tiermem.swap"""
