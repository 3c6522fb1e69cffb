"""The speculative algorithm: the engine, one step per mode, drafters, trees, tiers, acceptance."""
