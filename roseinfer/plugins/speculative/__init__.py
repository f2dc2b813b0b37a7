"""Built-in proposers for speculative decoding (roseinfer/core/speculation.py)."""
from roseinfer.core.hookspecs import hookimpl


@hookimpl
def roseinfer_register_proposers(register):
    from roseinfer.plugins.speculative.draft import DraftModel
    from roseinfer.plugins.speculative.mtp import MultiTokenPrediction
    from roseinfer.plugins.speculative.ngram import Ngram

    register("ngram", Ngram)
    register("draft", DraftModel)
    register("mtp", MultiTokenPrediction)
