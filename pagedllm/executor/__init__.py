"""Executors run the model runner(s): in-process today; multi-process / Ray later."""
