"""The node agent: what runs on each GPU node (the co-location guard, ...) and talks to the cards."""
