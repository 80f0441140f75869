"""Published numbers of the Bamboo thesis (chapter 3) that the simulator benchmarks set beside
the simulator's output. Nothing in ``stalwart`` depends on them."""

#: Table 3.3 (BERT-large, D=4, P=12, 1,000 simulated runs per probability): hourly preemption
#: probability -> (preemptions, interval hours, fatal failures, nodes, throughput samples/s,
#: cost $/h, value).
TABLE_3_3 = {
    0.01: (8.50, 2.08, 0.06, 45.18, 87.99, 41.11, 2.10),
    0.05: (48.15, 0.44, 0.23, 43.65, 76.35, 39.73, 1.90),
    0.10: (99.77, 0.23, 0.29, 41.69, 72.12, 37.94, 1.88),
    0.25: (276.52, 0.10, 1.04, 35.80, 60.12, 32.58, 1.82),
    0.50: (709.83, 0.06, 5.98, 26.96, 40.37, 24.53, 1.59),
}
#: Table 3.3's on-demand value ("which is 1.1").
ON_DEMAND_VALUE = 1.10
#: Table 3.2, real BERT runs (Bamboo-S): value at the 10% and the 33% hourly preemption rate.
REAL_RUN_VALUES = (2.34, 1.65)
#: §3.6.1: reconfiguration took "an average of 7% of the total training time" on the real
#: traces of these hourly preemption rates.
RECONFIG_SHARE = 0.07
RECONFIG_RATES = (0.10, 0.16, 0.33)
#: §3.6.3: share of time spent on actual training, checkpoint/restart vs Bamboo (real runs).
USEFUL_SHARE = {"checkpoint": 0.23, "bamboo": 0.84}
#: BERT iteration seconds of 3, 2 and 1 pipelines of 8 stages, the input of the thesis
#: authors' simulator (``project_pactum/simulation/simulator.py`` in uclasystem/bamboo).
STEP_SECONDS = {3: 2.3, 2: 3.1, 1: 5.7}
