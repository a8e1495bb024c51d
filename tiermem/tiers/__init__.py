"""tiermem.tiers"""
