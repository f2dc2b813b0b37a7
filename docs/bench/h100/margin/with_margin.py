"""python3 scratch/gain.py MIN_GAIN SPEC: decode_profile of SPEC with skinny_linear.MIN_GAIN set, the
loader's per-shape choice logged."""
import logging, os, runpy, sys
sys.path.insert(0, os.getcwd())
logging.basicConfig(level=logging.WARNING)
logging.getLogger("roseinfer.models.skinny_linear").setLevel(logging.INFO)
from roseinfer.models import skinny_linear
skinny_linear.MIN_GAIN = float(sys.argv[1])
sys.argv = ["decode_profile.py", *sys.argv[2:]]
runpy.run_path("docs/bench/decode_profile.py", run_name="__main__")
