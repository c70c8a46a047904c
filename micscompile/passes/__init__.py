"""Graph passes: each is ``name_pass(graph, ctx) -> graph`` (no code generation:
the caller builds one GraphModule at the end); analyses live beside them."""
