"""Named Cypher queries. Each one runs unchanged on Neo4j and on Ladybug, with parameters.

``MERGE_*`` write the graph; ``SUITE`` holds the README's example queries, which the tests run on
both backends and compare.
"""
from __future__ import annotations

MERGE_ZOOS = "UNWIND $rows AS r MERGE (:Zoo {name: r.name})"
MERGE_DATASETS = "UNWIND $rows AS r MERGE (:Dataset {name: r.name})"
MERGE_ARCHITECTURES = (
    "UNWIND $rows AS r MERGE (a:Architecture {architecture_id: r.architecture_id}) "
    "SET a.summary = r.summary, a.num_params = r.num_params, a.num_nodes = r.num_nodes, "
    "a.num_edges = r.num_edges, a.num_layers = r.num_layers, a.num_conv = r.num_conv, "
    "a.num_linear = r.num_linear, a.has_batchnorm = r.has_batchnorm, a.has_residual = r.has_residual")
MERGE_LAYERS = (
    "UNWIND $rows AS r MERGE (l:Layer {layer_id: r.layer_id}) "
    "SET l.architecture_id = r.architecture_id, l.position = r.position, l.kind = r.kind, "
    "l.relation = r.relation, l.in_size = r.in_size, l.out_size = r.out_size, l.kernel_h = r.kernel_h, "
    "l.kernel_w = r.kernel_w, l.groups = r.groups, l.activation = r.activation")
MERGE_HAS_LAYER = (
    "UNWIND $rows AS r MATCH (a:Architecture {architecture_id: r.architecture_id}), (l:Layer {layer_id: r.layer_id}) "
    "MERGE (a)-[h:HAS_LAYER]->(l) SET h.position = r.position")
MERGE_FEEDS = (
    "UNWIND $rows AS r MATCH (a:Layer {layer_id: r.src}), (b:Layer {layer_id: r.dst}) MERGE (a)-[:FEEDS]->(b)")
# model properties are set by a generated SET list over validated property names (see base.py)
MERGE_MODELS_HEAD = "UNWIND $rows AS r MERGE (m:Model {model_id: r.model_id})"
MERGE_CONTAINS = (
    "UNWIND $rows AS r MATCH (z:Zoo {name: r.zoo}), (m:Model {model_id: r.model_id}) MERGE (z)-[:CONTAINS]->(m)")
MERGE_HAS_ARCHITECTURE = (
    "UNWIND $rows AS r MATCH (m:Model {model_id: r.model_id}), (a:Architecture {architecture_id: r.architecture_id}) "
    "MERGE (m)-[:HAS_ARCHITECTURE]->(a)")
MERGE_TRAINED_ON = (
    "UNWIND $rows AS r MATCH (m:Model {model_id: r.model_id}), (d:Dataset {name: r.dataset}) "
    "MERGE (m)-[:TRAINED_ON]->(d)")
MERGE_SIMILAR = (
    "UNWIND $rows AS r MATCH (a:Model {model_id: r.a}), (b:Model {model_id: r.b}) "
    "MERGE (a)-[s:SIMILAR_TO {run_id: r.run_id}]->(b) SET s.score = r.score")
DELETE_ALL = "MATCH (n) DETACH DELETE n"
COUNT_MODELS = "MATCH (m:Model) RETURN count(m) AS models"


def set_model_props(props: list[str]) -> str:
    """``MERGE_MODELS_HEAD`` plus one SET per (validated) property; null leaves a value as it is."""
    sets = ", ".join(f"m.`{p}` = coalesce(r.`{p}`, m.`{p}`)" for p in props)
    return MERGE_MODELS_HEAD + (f" SET {sets}" if sets else "")


def set_model_property(prop: str) -> str:
    return (f"UNWIND $rows AS r MATCH (m:Model {{model_id: r.model_id}}) "
            f"SET m.`{prop}` = r.value, m.`{prop}_run` = r.run_id")


# ----------------------------------------------------------------------------- README suite
CONV_HEAVY_ARCHITECTURES = (
    "MATCH (a:Architecture)-[:HAS_LAYER]->(l:Layer) WHERE l.kind = 'conv' "
    "WITH a, count(l) AS convs WHERE convs > 2 "
    "RETURN a.architecture_id AS architecture, convs ORDER BY architecture")
MODELS_PER_ARCHITECTURE = (
    "MATCH (m:Model)-[:HAS_ARCHITECTURE]->(a:Architecture) "
    "RETURN a.architecture_id AS architecture, count(m) AS models, avg(m.test_accuracy) AS mean_accuracy "
    "ORDER BY models DESC, architecture")
ADAM_WITH_BATCHNORM = (
    "MATCH (m:Model)-[:HAS_ARCHITECTURE]->(a:Architecture)-[:HAS_LAYER]->(l:Layer) "
    "WHERE m.optimizer = 'adam' AND l.kind = 'batch_norm' "
    "RETURN DISTINCT m.model_id AS model ORDER BY model")
RESIDUAL_ARCHITECTURES = (
    "MATCH (a:Architecture)-[:HAS_LAYER]->(l:Layer) WHERE l.kind = 'residual' "
    "RETURN DISTINCT a.architecture_id AS architecture ORDER BY architecture")
SAME_ARCHITECTURE_NEIGHBOURS = (
    "MATCH (m:Model {model_id: $model_id})-[:HAS_ARCHITECTURE]->(a:Architecture)<-[:HAS_ARCHITECTURE]-(n:Model) "
    "WHERE n.model_id <> $model_id RETURN n.model_id AS neighbour, n.test_accuracy AS accuracy "
    "ORDER BY neighbour")
SIMILAR_NEIGHBOURS = (
    "MATCH (m:Model {model_id: $model_id})-[s:SIMILAR_TO]->(n:Model) "
    "RETURN n.model_id AS neighbour, s.score AS score ORDER BY score DESC, neighbour")
FEEDS_INTO_RESIDUAL = (
    "MATCH (a:Architecture)-[:HAS_LAYER]->(l:Layer)-[:FEEDS]->(r:Layer) WHERE r.kind = 'residual' "
    "RETURN a.architecture_id AS architecture, l.kind AS kind, count(*) AS n ORDER BY architecture, kind")

SUITE = {
    "conv_heavy_architectures": CONV_HEAVY_ARCHITECTURES,
    "models_per_architecture": MODELS_PER_ARCHITECTURE,
    "adam_with_batchnorm": ADAM_WITH_BATCHNORM,
    "residual_architectures": RESIDUAL_ARCHITECTURES,
    "same_architecture_neighbours": SAME_ARCHITECTURE_NEIGHBOURS,
    "similar_neighbours": SIMILAR_NEIGHBOURS,
    "feeds_into_residual": FEEDS_INTO_RESIDUAL,
}
