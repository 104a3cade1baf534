"""Model families (one file each), their shared layers and the architecture registry."""
