"""Graph passes: each is ``name_pass(gm, ctx) -> gm``; analyses live beside them."""
