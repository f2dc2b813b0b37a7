"""python3 docs/bench/h100/margin/with_margin.py MARGIN MODEL:BATCH: decode_profile.py's
decode step with skinny_linear.CUBLAS_MARGIN set to MARGIN (0.02 is the rule in use;
-0.03 is the previous one, the kernel only where at least 3 % faster), each linear
shape's choice logged. decode_profile.txt here ran the same with the previous module,
whose MIN_GAIN was the negated margin (0.03 and -0.02)."""
import logging
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
logging.basicConfig(level=logging.WARNING)
logging.getLogger("roseinfer.layers.skinny_linear").setLevel(logging.INFO)
from roseinfer.layers import skinny_linear  # noqa: E402

skinny_linear.CUBLAS_MARGIN = float(sys.argv[1])
sys.argv = ["decode_profile.py", *sys.argv[2:]]
runpy.run_path("docs/bench/decode_profile.py", run_name="__main__")
