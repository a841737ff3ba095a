"""The SGLang layer: the one launch command builder and the HTTP clients of engines and routers."""
