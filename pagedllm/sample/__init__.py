"""Token sampling for a whole batch at once."""
