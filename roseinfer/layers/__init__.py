"""The building blocks model families are made of, and their kernels: linears in each
precision (CPU, skinny CUDA, FP8, INT4), norms, rotary embeddings, paged attention, the
vocabulary-split embedding and LM head, the fused elementwise kernels, and the
mixture-of-experts MLP. A family file (roseinfer/models/) composes these; nothing here
knows a family."""
