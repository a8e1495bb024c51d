"""The end-to-end demo (``tiermem demo``): train a small GPT through tiermem."""
