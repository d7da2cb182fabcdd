"""TensorFlow 2.21's oneDNN broadcast-matmul bug, found in traced graphs before they run
(notebook 01, section 10): gradtut refuses or routes around it rather than return its numbers."""
import tensorflow as tf


def onednn_enabled():
    """Whether this TensorFlow runs with oneDNN's CPU kernels: TensorFlow's default on Linux x86
    CPUs with AVX512-VNNI, AVX512_BF16, AVX-VNNI or AMX, and off on older ones (AVX2-only, for
    one). ``TF_ENABLE_ONEDNN_OPTS=1`` or ``0``, set before TensorFlow starts, decides instead.

    Example:
      >>> onednn_enabled() in (True, False)
      True
    """
    try:
        from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return False


def broadcast_matmul_hazards(graph):
    """Batch matmuls in a traced graph that TensorFlow 2.21's oneDNN kernel gets wrong.

    With oneDNN on (TensorFlow's default on Linux x86 CPUs with AVX512-VNNI, AVX512_BF16,
    AVX-VNNI or AMX; off on older ones, see :func:`onednn_enabled`), ``tf.linalg.matmul`` of a
    ``[8, 1, 4, 8]`` tensor with an ``[8, 8]`` matrix returns garbage or corrupts the heap
    (tensorflow/tensorflow#117700; fixed upstream by PR #120199, after 2.21).
    ``tf.vectorized_map`` and ``tape.jacobian`` create exactly such ops from a layer's
    ``[1, T, d] @ [d, n]`` (attention, Dense on sequences). Flagged: a batch matmul whose output
    has two or more batch axes, one of them of size 1 (or unknown), where one operand broadcasts
    over the other's batch axes.

    Args:
      graph: a ``tf.Graph``, such as ``fn.get_concrete_function(...).graph`` of a
        ``tf.function``; the functions it calls are searched too.

    Returns:
      list of ``"op name: shape @ shape"`` strings; empty when oneDNN is off.

    Raises:
      TypeError: ``graph`` is not a ``tf.Graph``.

    Example:
      >>> fn = tf.function(lambda a: tf.linalg.matmul(a, tf.ones([8, 8])))
      >>> graph = fn.get_concrete_function(tf.TensorSpec([8, 1, 4, 8])).graph
      >>> len(broadcast_matmul_hazards(graph)) == onednn_enabled()  # flagged only with oneDNN
      True
    """
    if not isinstance(graph, tf.Graph):
        fix = (" (a tf.function: pass fn.get_concrete_function(*args).graph)"
               if hasattr(graph, "get_concrete_function") else "")
        raise TypeError(f"graph must be a tf.Graph, got {type(graph).__name__}{fix}")
    if not onednn_enabled():
        return []
    found, seen = [], set()

    def walk(g):
        if id(g) in seen:
            return
        seen.add(id(g))
        for op in g.get_operations():
            if is_broadcast_matmul_hazard(op):
                found.append(f"{op.name}: {op.inputs[0].shape} @ {op.inputs[1].shape}")
        for function in getattr(g, "_functions", {}).values():
            if getattr(function, "graph", None) is not None:
                walk(function.graph)

    walk(graph)
    return found


def is_broadcast_matmul_hazard(op):
    """Whether ``op`` (an operation of a traced graph) is a batch matmul of the shape that
    :func:`broadcast_matmul_hazards` flags, whether or not oneDNN is on.

    Raises:
      TypeError: ``op`` is not a ``tf.Operation``.

    Example:
      >>> fn = tf.function(lambda a: tf.linalg.matmul(a, tf.ones([8, 8])))
      >>> graph = fn.get_concrete_function(tf.TensorSpec([8, 1, 4, 8])).graph
      >>> [is_broadcast_matmul_hazard(op) for op in graph.get_operations()
      ...  if op.type.startswith("BatchMatMul")]
      [True]
    """
    if not isinstance(op, tf.Operation):
        raise TypeError(f"op must be a tf.Operation of a graph (graph.get_operations()), got "
                        f"{type(op).__name__}")
    if op.type not in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        return False
    a, b = (t.shape for t in op.inputs[:2])
    if a.rank is None or b.rank is None:
        return True
    batch_a, batch_b = list(a[:-2]), list(b[:-2])
    width = max(len(batch_a), len(batch_b))
    batch_a = [1] * (width - len(batch_a)) + batch_a
    batch_b = [1] * (width - len(batch_b)) + batch_b
    broadcast = any(p != q for p, q in zip(batch_a, batch_b, strict=True))
    size_one = any(p in (1, None) and q in (1, None) for p, q in zip(batch_a, batch_b, strict=True))
    return width >= 2 and broadcast and size_one

