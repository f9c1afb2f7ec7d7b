"""The steps: ``GraphConfig`` and its validation, the train and eval steps, ``make_train_step`` /
``make_eval_step``. The top layer: it may import the engine's capture interface and the graph layer.
"""
