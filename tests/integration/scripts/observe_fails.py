"""A training script that fails before its first step, with its own exit code."""

import sys

print("loading the dataset from /data/imagenet", flush=True)
print("fatal: /data/imagenet does not exist", flush=True)
sys.exit(3)
