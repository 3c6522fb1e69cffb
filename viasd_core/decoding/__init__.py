"""The decoding core: the static-cache model, the engine and its steps, drafters, the feature head, routing, sampling, slim views and weight formats."""
