"""fence-gateway: a fencing reverse proxy for the side-effecting tools AI agents call."""
