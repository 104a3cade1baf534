"""Executors run the model runner(s): in-process ("uni") or one worker process per
tensor-parallel rank ("mp"); Ray later."""
