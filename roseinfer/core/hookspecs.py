"""pluggy hook specifications: every kind of plugin registers named factories.

Each hook receives a ``register(name, factory)`` callback, as simonw/llm's
``register_models`` does; config then picks an implementation by name.
"""
import pluggy

PROJECT = "roseinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def roseinfer_register_kv_append_backends(register):
    """Register KV-append backends: ``register(name, factory)``.

    ``factory()`` returns an object with ``supports(slots, device) -> bool``
    and ``append(k_cache, v_cache, key, value, slots) -> None``
    (see ``roseinfer.core.kv_cache``).
    """


@hookspec
def roseinfer_register_metadata_stores(register):
    """Register block metadata stores: ``register(name, factory)``.

    ``factory(num_blocks, block_size)`` returns a ``MetadataStore``
    (see ``roseinfer.core.blocks``).
    """


@hookspec
def roseinfer_register_attention_backends(register):
    """Register attention backends: ``register(name, factory)``.

    ``factory()`` returns an object with ``supports(device) -> bool`` and
    ``forward(q, k_cache, v_cache, attn, scale) -> out``
    (see ``roseinfer.core.attention``).
    """


@hookspec
def roseinfer_register_model_architectures(register):
    """Register model families by transformers ``model_type``: ``register(model_type, cls)``.

    ``cls(hf_config)`` builds the module (on the meta device; the loader
    materializes it). It has ``forward(input_ids, positions) -> hidden``,
    ``compute_logits(hidden)``, ``bind_head()``, a ``head`` (``LogitsHead``)
    and a static ``convert_hf_state_dict(state_dict, hf_config)``; it attends
    through ``roseinfer.layers.attention.PagedAttention``, whose layers size the
    KV cache (see ``roseinfer.models.llama``).
    """


@hookspec
def roseinfer_register_logits_processors(register):
    """Register logits processors: ``register(name, factory)``. A request picks
    them by name (``SamplingParams.logits_processors``: name -> args); the
    config names the one behind ``response_format`` (``structured_output``).

    ``factory(ctx)`` builds the processor, once per engine on first use;
    ``ctx`` (``roseinfer.core.processors.ProcessorContext``) has the
    tokenizer, vocabulary size, EOS ids and device. The processor has
    ``start(args, prompt_ids) -> state`` (raise ``ValueError`` on bad args:
    the request is refused with its message) and ``apply(logits, rows,
    states)``, which changes rows ``rows`` of ``logits`` [R, V] in place,
    ``states[i]`` being row ``rows[i]``'s; ``state.accept(token_ids)`` sees
    every token its sequence takes (see ``roseinfer.core.processors``).
    """


@hookspec
def roseinfer_register_quantization_methods(register):
    """Register quantization methods: ``register(name, factory)``. Config picks one by
    name (``quantization``); a checkpoint's own ``quantization_config`` picks the method
    whose ``factory.reads(quantization_config)`` is true.

    ``factory(quantization_config or None)`` builds the method; ``factory.formats``
    names what it reads, for errors. The method has ``load_weights(tensors) ->
    tensors`` (called for checkpoints it reads), which turns the quantized tensors (by
    checkpoint name; safetensors slices or tensors) into the float ``<layer>.weight``
    each family loads, and ``quantize(model)``, called once the model is loaded, which
    quantizes its linears in place where the weights came in float (the LM head and
    embeddings stay as they are) (see ``roseinfer.models.quantization``).
    """


@hookspec
def roseinfer_register_tool_parsers(register):
    """Register tool-call parsers: ``register(name, factory)``. Config picks one by name
    (``tool_call_parser``; "auto": by the model's family).

    ``factory()`` returns a parser with ``start(text) -> int`` (where a call may begin in
    an output so far: the text before it streams as content) and ``parse(text) ->
    (content, calls)`` of a whole output (``roseinfer.core.tools.ToolParser``), raising
    ValueError for a call it cannot read.
    """


@hookspec
def roseinfer_register_reasoning_parsers(register):
    """Register reasoning parsers: ``register(name, factory)``. Config picks one by name
    (``reasoning_parser``; "auto": by the model's family, "none": no split).

    ``factory()`` returns a parser with ``start`` and ``end``, the tags around the
    reasoning, and ``opened(prompt) -> bool``: whether an output of that rendered chat
    prompt begins inside the reasoning (``roseinfer.core.reasoning.ReasoningParser``).
    """


@hookspec
def roseinfer_register_proposers(register):
    """Register speculative-decoding proposers: ``register(name, factory)``. Config picks
    one by name (``speculative``).

    ``factory(ctx)`` builds the proposer once per engine; ``ctx``
    (``roseinfer.core.speculation.ProposerContext``) has the engine's config, device,
    dtype, vocabulary size, plugins and ``k``. The proposer has ``propose(token_ids,
    room) -> drafts``: for each sequence (its prompt and output ids so far) a
    ``Draft`` of at most ``room[i]`` tokens, or None to propose nothing. A ``Draft``
    holds the tokens and, for a proposer that samples them, the distribution each was
    drawn from; the engine checks them (see ``roseinfer.core.speculation``).

    A proposer that drafts from the model's final hidden states sets
    ``needs_hidden_states = True``: ``ctx.target`` then has the model, its KV cache and
    runner; ``propose`` gets the sequences themselves (``key``, ``token_ids``) instead of
    their ids; and after every step ``observe(seqs, firsts, counts, hidden)`` gets the
    positions each sequence computed and kept and the hidden states there (the built-in
    ``mtp``, roseinfer/plugins/speculative/mtp.py). The engine then runs eagerly.
    """
