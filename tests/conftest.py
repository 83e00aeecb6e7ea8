import os
import sys

# Spawned ranks unpickle test functions by module name: make tests/ importable in them.
sys.path.insert(0, os.path.dirname(__file__))
