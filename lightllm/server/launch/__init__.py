"""Start-up: the argument parser, its checks, sizing, and one launcher per run mode.

``arg_parser`` is the one source of every flag; ``args_check`` refuses impossible combinations;
``sizing``/``kv_budget``/``plan`` turn flags and the checkpoint into process configurations as
pure functions; ``start`` (normal server and the dispatch by ``--run_mode``), ``pd_master`` and
``pd_node`` spawn and supervise the processes (``supervisor``). This package is the composition
root: it may import anything below it, and nothing imports it but ``api_server``. It imports no
torch: ``device_probe`` asks a short-lived child for the CUDA facts, and ``child_entry`` holds the
children's entries, so only a model rank imports the rank's (torch) code.
"""
