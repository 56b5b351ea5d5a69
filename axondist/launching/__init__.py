"""Starting a job. In this process: :mod:`~axondist.launching.worlds` (``init`` for a launched
rank, ``spawn`` for ranks on threads, ``run`` for either). Starting processes: ``axondist
run``'s :mod:`~axondist.launching.supervisor`, with its command line
(:mod:`~axondist.launching.command_line`), one style per launcher
(:mod:`~axondist.launching.styles`) and its failure summary
(:mod:`~axondist.launching.failure`). Inside each rank it starts:
:mod:`~axondist.launching.in_rank`.

The package is not named ``axondist.run``: that name is the public function
:func:`axondist.run`, which a subpackage of the same name would replace on import."""
