"""Drop-ins for the users of the projects quant's strategies come from: ``actnn`` (ActNN's
levels and Q-layers), ``gact`` (GACT's controller) and ``mesa`` (Mesa's layers and policy
files). Each keeps its upstream's names; the strategies themselves live in the package."""
