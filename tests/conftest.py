import os
import sys

# programs.py and reference.py are imported by name, also inside spawned gloo processes
sys.path.insert(0, os.path.dirname(__file__))
