"""Local stub (not upstream): only the token-type constants model.py imports."""
TEXT = -1
IMAGE = 0
IMAGE_START = 1
IMAGE_END = 2
IMAGE_NEW_LINE = 3
