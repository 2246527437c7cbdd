"""The address map and the rewriter that keeps every upstream broker address away from clients."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol.messages import (
    Request,
    Response,
    apis,
    body_class,
    decode_response,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.protocol.schema import StructSpec
from kproxy.proxy.actions import Listen, ToClient
from kproxy.proxy.addresses import (
    AddressMap,
    AddressMapError,
    AddressRewriter,
    Route,
    apis_with_endpoints,
    endpoint_sites,
)
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.session import Session

from ..protocol.strategies import message_strategy

PRODUCE, FETCH, METADATA, FIND_COORDINATOR, DESCRIBE_QUORUM, DESCRIBE_CLUSTER = 0, 1, 3, 10, 55, 60
SHARE_FETCH, SHARE_ACKNOWLEDGE, STREAMS_GROUP_HEARTBEAT, STREAMS_GROUP_DESCRIBE = 78, 79, 88, 89
PROXY = "proxy.example"


def make_map(**kw) -> AddressMap:
    kw.setdefault("port_start", 19000)
    kw.setdefault("port_count", 16)
    return AddressMap(PROXY, **kw)


# -- AddressMap


def test_deterministic_ports_follow_node_ids_not_discovery_order():
    m = make_map(node_id_base=1)
    assert m.expose("broker", 5, "b5.internal", 9092) == (PROXY, 19004)
    assert m.expose("broker", 1, "b1.internal", 9092) == (PROXY, 19000)
    assert m.expose("broker", 16, "b16.internal", 9092) == (PROXY, 19015)
    assert m.route_for_port(19004) == Route("broker", 5, ("b5.internal", 9092))
    assert m.route_for_node(1) == Route("broker", 1, ("b1.internal", 9092))
    assert m.exposed_ports() == [19000, 19004, 19015]


@pytest.mark.parametrize("node_id", [0, 17, 1000])
def test_deterministic_port_outside_the_range_is_an_error(node_id):
    m = make_map(node_id_base=1)
    with pytest.raises(AddressMapError, match=f"broker node {node_id}"):
        m.expose("broker", node_id, "b.internal", 9092)
    assert m.exposed_ports() == []


def test_discovery_order_without_a_base():
    m = make_map()
    assert m.expose("broker", 42, "b42", 9092) == (PROXY, 19000)
    assert m.expose("broker", 7, "b7", 9092) == (PROXY, 19001)
    assert m.expose("broker", 42, "b42", 9092) == (PROXY, 19000)
    assert m.expose("broker", 1000, "b1000", 9092) == (PROXY, 19002)


def test_discovery_runs_out_of_ports():
    # The error names the setting to change (it reaches the log once per node).
    m = make_map(port_count=2)
    m.expose("broker", 1, "b1", 9092)
    m.expose("broker", 2, "b2", 9092)
    with pytest.raises(AddressMapError, match=r"exposure\.broker_port_count"):
        m.expose("broker", 3, "b3", 9092)


def test_controllers_get_ports_of_their_own_from_the_top():
    m = make_map(node_id_base=0)
    assert m.expose("controller", 1, "c1", 9093) == (PROXY, 19015)
    assert m.expose("broker", 1, "c1", 9092) == (PROXY, 19001)
    assert m.expose("controller", 2, "c2", 9093) == (PROXY, 19014)
    assert m.route_for_node(1, "controller") == Route("controller", 1, ("c1", 9093))
    assert m.route_for_node(1) == Route("broker", 1, ("c1", 9092))


def test_a_moved_broker_keeps_its_port_and_leads_to_its_new_place():
    m = make_map()
    assert m.expose("broker", 1, "old-host", 9092) == (PROXY, 19000)
    m.confirm(19000)
    assert m.expose("broker", 1, "new-host", 9094) == (PROXY, 19000)
    assert m.route_for_port(19000) == Route("broker", 1, ("new-host", 9094))
    assert m.upstream_endpoints() == {("new-host", 9094)}
    assert m.pending_ports() == []


def test_a_new_port_is_pending_until_the_server_confirms_it_is_bound():
    m = make_map(node_id_base=0)
    for _ in range(3):
        for node in (2, 0, 2, 1):
            m.expose("broker", node, f"b{node}", 9092)
        m.expose("controller", 0, "c0", 9093)
    assert m.pending_ports() == [19000, 19001, 19002, 19015]
    for port in (19000, 19001, 19002, 19015):
        m.confirm(port)
    m.expose("broker", 2, "b2", 9092)
    assert m.pending_ports() == []


def test_a_port_that_cannot_be_bound_is_withdrawn_and_never_advertised_again():
    m = make_map()
    assert m.expose("broker", 1, "b1", 9092) == (PROXY, 19000)
    route = m.withdraw(19000, "address in use")
    assert route == Route("broker", 1, ("b1", 9092))
    assert m.route_for_port(19000) is None and m.pending_ports() == []
    # The node gets the next port; 19000 is skipped from now on, for every node.
    assert m.expose("broker", 1, "b1", 9092) == (PROXY, 19001)
    assert m.expose("broker", 2, "b2", 9092) == (PROXY, 19002)


def test_sni_names_every_node_on_one_port():
    m = make_map(sni_domain="kafka.example.com", sni_port=9093)
    assert m.expose("broker", 1, "b1.internal", 9092) == ("broker-1.kafka.example.com", 9093)
    assert m.expose("controller", 1, "c1.internal", 9095) == ("controller-1.kafka.example.com", 9093)
    assert m.route_for_name("broker-1.kafka.example.com") == Route("broker", 1, ("b1.internal", 9092))
    assert m.route_for_name("BROKER-1.Kafka.Example.com") == Route("broker", 1, ("b1.internal", 9092))
    assert m.route_for_name("broker-2.kafka.example.com") is None
    assert m.route_for_node(1, "controller") == Route("controller", 1, ("c1.internal", 9095))
    assert m.upstream_endpoints() == {("b1.internal", 9092), ("c1.internal", 9095)}
    assert m.pending_ports() == [] and m.exposed_ports() == []


def test_sni_names_with_a_mixed_case_domain_are_found():
    m = make_map(sni_domain="Kafka.Example.COM", sni_port=9093)
    name, _ = m.expose("broker", 3, "b3.internal", 9092)
    assert m.route_for_name(name) == Route("broker", 3, ("b3.internal", 9092))
    assert m.route_for_name("broker-3.kafka.example.com") == Route("broker", 3, ("b3.internal", 9092))


# -- where endpoints are, from the schema


def test_apis_with_endpoints():
    keys = apis_with_endpoints()
    assert {PRODUCE, FETCH, METADATA, FIND_COORDINATOR, DESCRIBE_QUORUM, DESCRIBE_CLUSTER,
            SHARE_FETCH, SHARE_ACKNOWLEDGE} <= keys
    # Kafka Streams application endpoints belong to the client, not the cluster.
    assert STREAMS_GROUP_DESCRIBE not in keys


def sites(api_key: int, v: int) -> list[list[tuple[str, bool, str | None]]]:
    msg = apis()[api_key].response
    assert msg is not None
    return [[(s.field, s.array, s.node_field) for s in path] for path in endpoint_sites(msg, v)]


def test_endpoint_sites():
    assert sites(METADATA, 0) == [[("brokers", True, "node_id")]]
    assert sites(FIND_COORDINATOR, 3) == [[]]
    assert sites(FIND_COORDINATOR, 4) == [[("coordinators", True, "node_id")]]
    assert sites(PRODUCE, 9) == []
    assert sites(PRODUCE, 10) == [[("node_endpoints", True, "node_id")]]
    assert sites(FETCH, 15) == []
    assert sites(FETCH, 16) == [[("node_endpoints", True, "node_id")]]
    assert sites(DESCRIBE_CLUSTER, 0) == [[("brokers", True, "broker_id")]]
    assert sites(DESCRIBE_QUORUM, 1) == []
    assert sites(DESCRIBE_QUORUM, 2) == [[("nodes", True, "node_id"), ("listeners", True, None)]]


# -- the rewriter, through a session as in the proxy


def round_trip(api_key: int, version: int, body, request_body=None, address_map: AddressMap | None = None):
    """Send a request through a session with the rewriter, answer it with ``body``; what the client gets."""
    m = address_map or make_map()
    s = Session(ConnectionContext(1), FilterChain([AddressRewriter(m)]))
    if request_body is None:
        request_body = body_class(api_key, "request")()
        if api_key == PRODUCE:
            request_body.acks = -1  # acks=0 would get no response
    req = Request.build(api_key, version, 99, "app", request_body)
    out = s.client_frame(memoryview(b"".join(encode_request_frame(req))[4:]))
    upstream_id = out[-1].buffers[0][4 + 4:4 + 8]
    frame = bytes(upstream_id) + b"".join(encode_response_frame(Response.build(api_key, version, 0, body)))[8:]
    out = s.upstream_frame(memoryview(frame))
    listen = [a for a in out if isinstance(a, Listen)]
    # Ports the answer names are opened before it is written, and only ports not yet listening.
    assert [type(a) for a in out] == [Listen, ToClient] if m.pending_ports() else [ToClient]
    if listen:
        assert set(listen[0].ports) <= set(m.pending_ports())
    data = b"".join(bytes(b) for b in out[-1].buffers)
    resp = decode_response(data[4:], api_key, version)
    assert resp.correlation_id == 99
    return resp.body, m


def metadata(brokers):
    cls = body_class(METADATA, "response")
    return cls(brokers=[cls.MetadataResponseBroker(node_id=n, host=h, port=p, rack="r1") for n, h, p in brokers])


@pytest.mark.parametrize("version", [0, 1, 12, 13])
def test_metadata_brokers_are_rewritten(version):
    body, m = round_trip(METADATA, version, metadata([(1, "b1.internal", 9092), (2, "b2.internal", 9092)]))
    assert [(b.node_id, b.host, b.port) for b in body.brokers] == [(1, PROXY, 19000), (2, PROXY, 19001)]
    if version >= 1:
        assert body.brokers[0].rack == "r1"
    assert m.route_for_port(19001) == Route("broker", 2, ("b2.internal", 9092))


def test_find_coordinator_v3_top_level():
    cls = body_class(FIND_COORDINATOR, "response")
    body, m = round_trip(FIND_COORDINATOR, 3, cls(node_id=4, host="coord.internal", port=9092))
    assert (body.node_id, body.host, body.port) == (4, PROXY, 19000)
    assert m.route_for_port(19000) == Route("broker", 4, ("coord.internal", 9092))


@pytest.mark.parametrize("version", [0, 3])
def test_find_coordinator_top_level_error_is_not_exposed(version):
    cls = body_class(FIND_COORDINATOR, "response")
    body, m = round_trip(FIND_COORDINATOR, version, cls(error_code=15, node_id=-1, host="", port=-1))
    assert (body.node_id, body.host, body.port) == (-1, "", -1)
    assert m.pending_ports() == [] and m.exposed_ports() == []


@pytest.mark.parametrize("version", [4, 6])
def test_find_coordinator_v4_coordinators(version):
    cls = body_class(FIND_COORDINATOR, "response")
    body, m = round_trip(FIND_COORDINATOR, version, cls(coordinators=[
        cls.Coordinator(key="g1", node_id=3, host="b3.internal", port=9092),
        cls.Coordinator(key="g2", node_id=-1, host="", port=-1, error_code=15),
        # An error entry must not leak an upstream host even if a broker filled one in.
        cls.Coordinator(key="g3", node_id=-1, host="b9.internal", port=-1, error_code=15),
    ]))
    assert [(c.key, c.node_id, c.host, c.port) for c in body.coordinators] == [
        ("g1", 3, PROXY, 19000), ("g2", -1, "", -1), ("g3", -1, "", -1)]
    assert m.exposed_ports() == [19000]


@pytest.mark.parametrize("version", [0, 1, 2])
def test_describe_cluster_brokers(version):
    cls = body_class(DESCRIBE_CLUSTER, "response")
    body, m = round_trip(DESCRIBE_CLUSTER, version, cls(cluster_id="c", brokers=[
        cls.DescribeClusterBroker(broker_id=0, host="b0.internal", port=9092),
        cls.DescribeClusterBroker(broker_id=1, host="b1.internal", port=9092)]))
    assert [(b.broker_id, b.host, b.port) for b in body.brokers] == [(0, PROXY, 19000), (1, PROXY, 19001)]
    assert m.route_for_node(1) == Route("broker", 1, ("b1.internal", 9092))


def test_describe_cluster_controller_endpoints_do_not_take_broker_ports():
    # KIP-919: endpoint_type 2 lists controllers, which in combined mode share node ids with brokers.
    m = make_map(node_id_base=0)
    m.expose("broker", 1, "b1.internal", 9092)
    cls = body_class(DESCRIBE_CLUSTER, "response")
    body, _ = round_trip(DESCRIBE_CLUSTER, 1, cls(cluster_id="c", endpoint_type=2, brokers=[
        cls.DescribeClusterBroker(broker_id=1, host="b1.internal", port=9093)]), address_map=m)
    assert (body.brokers[0].host, body.brokers[0].port) == (PROXY, 19015)
    assert m.route_for_node(1) == Route("broker", 1, ("b1.internal", 9092))
    assert m.route_for_node(1, "controller") == Route("controller", 1, ("b1.internal", 9093))


@pytest.mark.parametrize(("api_key", "version"), [(PRODUCE, 10), (PRODUCE, 13), (FETCH, 16), (FETCH, 18),
                                                  (SHARE_FETCH, 1), (SHARE_ACKNOWLEDGE, 1),
                                                  (SHARE_ACKNOWLEDGE, 2)])
def test_node_endpoints_are_rewritten(api_key, version):
    cls = body_class(api_key, "response")
    body = cls(node_endpoints=[cls.NodeEndpoint(node_id=2, host="b2.internal", port=9092, rack="r"),
                               cls.NodeEndpoint(node_id=5, host="b5.internal", port=9192)])
    got, m = round_trip(api_key, version, body)
    assert [(e.node_id, e.host, e.port, e.rack) for e in got.node_endpoints] == [
        (2, PROXY, 19000, "r"), (5, PROXY, 19001, None)]
    assert m.route_for_node(5) == Route("broker", 5, ("b5.internal", 9192))


def test_describe_quorum_v2_listeners_are_controllers_named_by_their_node():
    cls = body_class(DESCRIBE_QUORUM, "response")
    body = cls(nodes=[
        cls.Node(node_id=3000, listeners=[cls.Listener(name="CONTROLLER", host="c0.internal", port=9093)]),
        cls.Node(node_id=3001, listeners=[cls.Listener(name="CONTROLLER", host="c1.internal", port=9093)])])
    m = make_map()
    m.expose("broker", 3000, "b.internal", 9092)  # a broker with the same id keeps its own port
    got, _ = round_trip(DESCRIBE_QUORUM, 2, body, address_map=m)
    assert [(n.node_id, [(li.name, li.host, li.port) for li in n.listeners]) for n in got.nodes] == [
        (3000, [("CONTROLLER", PROXY, 19015)]), (3001, [("CONTROLLER", PROXY, 19014)])]
    assert m.route_for_port(19015) == Route("controller", 3000, ("c0.internal", 9093))
    assert m.route_for_port(19000) == Route("broker", 3000, ("b.internal", 9092))


def test_streams_group_user_endpoints_are_left_alone():
    cls = body_class(STREAMS_GROUP_DESCRIBE, "response")
    body = cls(groups=[cls.DescribedGroup(group_id="app", members=[
        cls.Member(member_id="m", user_endpoint=cls.Endpoint(host="app-1.internal", port=8080))])])
    rewriter = AddressRewriter(make_map())
    assert STREAMS_GROUP_DESCRIBE not in rewriter.response_api_keys
    resp = Response.build(STREAMS_GROUP_DESCRIBE, 0, 1, body)
    rewriter.on_response(ConnectionContext(1), InFlight(1, resp.api_key, resp.api_version, 0.0), resp)  # even if called, nothing to rewrite
    got, m = round_trip(STREAMS_GROUP_DESCRIBE, 0, body)
    endpoint = got.groups[0].members[0].user_endpoint
    assert (endpoint.host, endpoint.port) == ("app-1.internal", 8080)
    assert m.exposed_ports() == []


# -- property: no upstream host survives, for every API and version that carries endpoints


def hosts(obj, spec: StructSpec, v: int, out: list) -> list:
    """Every (host, port) in a body, found from the schema independently of endpoint_sites."""
    present = {f.name: f for f in spec.fields if v in f.versions}
    if "host" in present and "port" in present:
        out.append((obj.host, obj.port))
    for f in present.values():
        value = getattr(obj, f.name)
        if f.type == "struct" and value is not None:
            assert f.struct is not None
            for item in value if f.array else [value]:
                hosts(item, f.struct, v, out)
    return out


def _responses_with_a_host_and_port() -> list[int]:
    """API keys whose response has a struct with ``host`` and ``port`` in some version: found by
    walking the schema here, not by asking the code under test (``apis_with_endpoints``)."""
    keys = []
    for key, api in sorted(apis().items()):
        msg = api.response
        assert msg is not None
        if any({"host", "port"} <= {f.name for f in s.fields} for s in msg.structs()):
            keys.append(key)
    return keys


# Kafka Streams application endpoints (no node id: StreamsGroupDescribe members, StreamsGroupHeartbeat
# partitions by user endpoint) are the client's own and stay as they are; the test above checks that,
# so this property leaves those APIs out.
CLIENTS_OWN_ENDPOINTS = {STREAMS_GROUP_DESCRIBE, STREAMS_GROUP_HEARTBEAT}

CASES = [pytest.param(key, v, id=f"{apis()[key].name}-v{v}")
         for key in _responses_with_a_host_and_port() if key not in CLIENTS_OWN_ENDPOINTS
         for v in range(apis()[key].response.versions.lo, apis()[key].response.versions.hi + 1)]  # type: ignore[union-attr]


def test_the_property_covers_every_api_the_rewriter_handles():
    assert set(apis_with_endpoints()) == {c.values[0] for c in CASES}


@pytest.mark.parametrize(("api_key", "version"), CASES)
def test_no_upstream_host_survives_rewriting(api_key, version):
    msg = apis()[api_key].response
    assert msg is not None

    @settings(max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(message_strategy(msg, version))
    def check(body):
        m = AddressMap(PROXY, 2000, 60000)
        resp = Response.build(api_key, version, 1, body)
        upstream = {h for h, _ in hosts(body, msg.root, version, [])} - {""}
        assert AddressRewriter(m).on_response(ConnectionContext(1), InFlight(1, resp.api_key, resp.api_version, 0.0), resp) == 0.0
        # Still a valid response (ports fit their field), and nothing upstream is left in it.
        frame = b"".join(encode_response_frame(resp))[4:]
        back = decode_response(frame, api_key, version)
        for host, port in hosts(back.body, msg.root, version, []):
            assert host in ("", PROXY)
            if host == PROXY:
                route = m.route_for_port(port)
                assert route is not None and route.upstream[0] in upstream
        assert upstream.isdisjoint(host for host, _ in hosts(back.body, msg.root, version, []))

    check()


def test_the_rewriter_reads_only_answer_versions_with_endpoints() -> None:
    # Produce answers carry KIP-951's leader endpoints from v10 on; before that the rewriter has
    # nothing to do, so a session with nothing else reading them passes them on undecoded.
    rewriter = AddressRewriter(AddressMap("kproxy.example", 19000, 16))
    chain = FilterChain([rewriter])
    assert not rewriter.reads_response(0, 9) and rewriter.reads_response(0, 10)
    assert rewriter.reads_response(3, 12) and rewriter.reads_response(10, 0)     # Metadata, FindCoordinator v0
    assert not chain.reads_answers(0, 9) and chain.reads_answers(3, 12)
    # From v10 a Produce answer is read only when its bytes carry node_endpoints (``reads_answer``).
    assert not chain.reads_answers(0, 10) and chain.answer_guards(0, 10) == (rewriter,)
    assert chain.answer_guards(0, 9) == () and chain.answer_guards(3, 12) == ()
