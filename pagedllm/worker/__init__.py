"""Model runner side: persistent input batch, KV cache sizing, one forward per step."""
