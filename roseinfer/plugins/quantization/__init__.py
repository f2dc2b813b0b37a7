"""Built-in quantization methods (roseinfer/models/quantization.py says what a method is)."""
from roseinfer.core.hookspecs import hookimpl


@hookimpl
def roseinfer_register_quantization_methods(register):
    from roseinfer.plugins.quantization.block_fp8 import BlockFp8
    from roseinfer.plugins.quantization.fp8 import Fp8
    from roseinfer.plugins.quantization.int4 import Int4
    from roseinfer.plugins.quantization.mxfp4 import Mxfp4

    register("block_fp8", BlockFp8)
    register("fp8", Fp8)
    register("int4", Int4)
    register("mxfp4", Mxfp4)
