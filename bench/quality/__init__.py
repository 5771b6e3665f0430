"""``python -m bench quality``: the observation-quality benchmark that gates changes to prompts,
recall and the engine. Labelled banks (banks/ and the real-model lane's), a judge, an oracle
server that answers from the labels, and the runner that drives the service's own entry points.
"""
