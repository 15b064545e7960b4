"""The report's sections, each a builder beside its captions: ``add(page, inputs, ...)`` places its tables and
figures on the ``analysis.page.Page`` and leaves a note where it has nothing to show. In report order:

- ``methods``: pass@k of each method (Tables 1, 3, 4, 9), the Branch grid (Table 6), the gradient norm
  by thirds (Table 5);
- ``differences``: each method minus the reference and minus the start model, with intervals, and the
  declared primary comparison (placed first);
- ``problems_moved``: which problems each compared pair lost and gained, and where its curves cross;
- ``anchor``: where the anchor acted, by token entropy;
- ``analyses``: reasoning patterns, strategy mix, and the testbed's tiers;
- ``perplexity``: perplexity of samples under the base model (Figure 7);
- ``curves``: the pass@k curves (Figure 3) and training reward vs held-out pass@1 (Figure 2).

A new section is a module here, called from ``analysis.assemble.make_report`` at its place in the report.
"""
