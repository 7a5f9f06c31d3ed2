"""Built-in scheduler plugins: fit filters, node policies, card policies, custom topology."""
