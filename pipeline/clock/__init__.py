"""The engine of ``pipe(x)``: GPipe's clock cycles on the workers; backward is autograd's.

``driver.py`` runs the cycles that ``cycles.py`` lists; ``dependency.py`` and ``phony.py`` order
the backward pass; ``copy.py`` moves micro-batches between devices; ``checkpoint.py`` checkpoints a
task; ``portal.py`` and ``skips.py`` carry skips across partitions; ``completion.py`` signals a
partition's final gradients. No imports here: import the module you mean.
"""
