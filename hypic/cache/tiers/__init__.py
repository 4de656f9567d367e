"""The public pool's lower tiers: a persistent directory (L3, local) and Mooncake Store (L3, shared)."""
