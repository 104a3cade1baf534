"""Images in prompts: decoding what users send (image.py) and turning images into the
pixels and placeholder runs a request carries (processor.py)."""
