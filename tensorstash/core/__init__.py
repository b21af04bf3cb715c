"""What every part speaks: the Policy protocol and its packed values (policy), the
session's counts (stats, shown by _render), a tensor's exact geometry as bytes
(_layout), the reasons a tensor went where it went (_reasons), timers (_timers),
and the kept values and counts in C or their Python twins (_fastpath, _fast.c).
Imports nothing else of tensorstash."""
