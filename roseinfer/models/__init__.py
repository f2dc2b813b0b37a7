"""Model families, looked up by transformers ``model_type`` among the registered
model-architecture plugins (roseinfer/plugins/models.py has the built-ins)."""


def model_class(hf_config, plugins=None):
    from roseinfer.core.plugins import default_registry

    plugins = plugins or default_registry()
    known = plugins.names("model")
    if hf_config.model_type not in known:
        raise ValueError(f"model type {hf_config.model_type!r} is not supported; supported: "
                         f"{', '.join(known)}. A plugin can add it "
                         "(roseinfer_register_model_architectures, docs/plugins.md)")
    return plugins.get("model", hf_config.model_type).factory
