/* Prints the sizes/offsets of the libibverbs structures that dxnet-verbs
 * declares itself, one "name value" pair per line, plus the enum values it
 * uses. Compiled and run by tests/layout.rs when <infiniband/verbs.h> and a
 * C compiler are available; the Rust side prints the same table from its own
 * #[repr(C)] declarations and the two must match exactly. */
#include <stddef.h>
#include <stdio.h>
#include <infiniband/verbs.h>

#define SZ(t) printf("size %s %zu\n", #t, sizeof(struct t))
#define OFF(t, f) printf("off %s.%s %zu\n", #t, #f, offsetof(struct t, f))
#define CONST(c) printf("const %s %lld\n", #c, (long long)(c))

int main(void)
{
	printf("size ibv_gid %zu\n", sizeof(union ibv_gid));

	SZ(ibv_context_ops);
	OFF(ibv_context_ops, poll_cq);
	OFF(ibv_context_ops, req_notify_cq);
	OFF(ibv_context_ops, post_srq_recv);
	OFF(ibv_context_ops, post_send);
	OFF(ibv_context_ops, post_recv);

	SZ(ibv_context);
	OFF(ibv_context, device);
	OFF(ibv_context, ops);
	OFF(ibv_context, cmd_fd);
	OFF(ibv_context, async_fd);
	OFF(ibv_context, num_comp_vectors);
	OFF(ibv_context, mutex);
	OFF(ibv_context, abi_compat);

	/* verbs_context sits in front of ibv_context; fields "grow up", so the
	 * distance of an op from the end of the struct is stable. */
	printf("vctx context_minus_query_port %zu\n",
	       offsetof(struct verbs_context, context) - offsetof(struct verbs_context, query_port));
	printf("vctx size_minus_query_port %zu\n",
	       sizeof(struct verbs_context) - offsetof(struct verbs_context, query_port));
	printf("vctx context_minus_sz %zu\n",
	       offsetof(struct verbs_context, context) - offsetof(struct verbs_context, sz));

	SZ(ibv_port_attr);
	OFF(ibv_port_attr, state);
	OFF(ibv_port_attr, max_mtu);
	OFF(ibv_port_attr, active_mtu);
	OFF(ibv_port_attr, gid_tbl_len);
	OFF(ibv_port_attr, port_cap_flags);
	OFF(ibv_port_attr, max_msg_sz);
	OFF(ibv_port_attr, pkey_tbl_len);
	OFF(ibv_port_attr, lid);
	OFF(ibv_port_attr, sm_lid);
	OFF(ibv_port_attr, lmc);
	OFF(ibv_port_attr, active_width);
	OFF(ibv_port_attr, active_speed);
	OFF(ibv_port_attr, phys_state);
	OFF(ibv_port_attr, link_layer);
	OFF(ibv_port_attr, flags);
	OFF(ibv_port_attr, port_cap_flags2);

	SZ(ibv_device_attr);
	OFF(ibv_device_attr, node_guid);
	OFF(ibv_device_attr, max_mr_size);
	OFF(ibv_device_attr, vendor_id);
	OFF(ibv_device_attr, max_qp);
	OFF(ibv_device_attr, max_qp_wr);
	OFF(ibv_device_attr, max_sge);
	OFF(ibv_device_attr, max_cqe);
	OFF(ibv_device_attr, max_mr);
	OFF(ibv_device_attr, atomic_cap);
	OFF(ibv_device_attr, max_srq);
	OFF(ibv_device_attr, max_srq_wr);
	OFF(ibv_device_attr, max_srq_sge);
	OFF(ibv_device_attr, max_pkeys);
	OFF(ibv_device_attr, local_ca_ack_delay);
	OFF(ibv_device_attr, phys_port_cnt);

	SZ(ibv_pd);
	OFF(ibv_pd, context);
	OFF(ibv_pd, handle);

	SZ(ibv_mr);
	OFF(ibv_mr, addr);
	OFF(ibv_mr, length);
	OFF(ibv_mr, handle);
	OFF(ibv_mr, lkey);
	OFF(ibv_mr, rkey);

	SZ(ibv_comp_channel);
	OFF(ibv_comp_channel, fd);

	SZ(ibv_cq);
	OFF(ibv_cq, context);
	OFF(ibv_cq, channel);
	OFF(ibv_cq, cq_context);
	OFF(ibv_cq, handle);
	OFF(ibv_cq, cqe);
	OFF(ibv_cq, mutex);
	OFF(ibv_cq, cond);
	OFF(ibv_cq, comp_events_completed);
	OFF(ibv_cq, async_events_completed);

	SZ(ibv_srq);
	OFF(ibv_srq, context);
	OFF(ibv_srq, srq_context);
	OFF(ibv_srq, pd);
	OFF(ibv_srq, handle);
	OFF(ibv_srq, mutex);
	OFF(ibv_srq, cond);
	OFF(ibv_srq, events_completed);

	SZ(ibv_qp);
	OFF(ibv_qp, context);
	OFF(ibv_qp, qp_context);
	OFF(ibv_qp, pd);
	OFF(ibv_qp, send_cq);
	OFF(ibv_qp, recv_cq);
	OFF(ibv_qp, srq);
	OFF(ibv_qp, handle);
	OFF(ibv_qp, qp_num);
	OFF(ibv_qp, state);
	OFF(ibv_qp, qp_type);
	OFF(ibv_qp, mutex);
	OFF(ibv_qp, cond);
	OFF(ibv_qp, events_completed);

	SZ(ibv_sge);
	OFF(ibv_sge, addr);
	OFF(ibv_sge, length);
	OFF(ibv_sge, lkey);

	SZ(ibv_send_wr);
	OFF(ibv_send_wr, wr_id);
	OFF(ibv_send_wr, next);
	OFF(ibv_send_wr, sg_list);
	OFF(ibv_send_wr, num_sge);
	OFF(ibv_send_wr, opcode);
	OFF(ibv_send_wr, send_flags);
	OFF(ibv_send_wr, imm_data);
	OFF(ibv_send_wr, wr);
	OFF(ibv_send_wr, wr.rdma.remote_addr);
	OFF(ibv_send_wr, wr.rdma.rkey);
	OFF(ibv_send_wr, wr.ud.remote_qpn);
	OFF(ibv_send_wr, qp_type);
	OFF(ibv_send_wr, bind_mw);

	SZ(ibv_recv_wr);
	OFF(ibv_recv_wr, wr_id);
	OFF(ibv_recv_wr, next);
	OFF(ibv_recv_wr, sg_list);
	OFF(ibv_recv_wr, num_sge);

	SZ(ibv_wc);
	OFF(ibv_wc, wr_id);
	OFF(ibv_wc, status);
	OFF(ibv_wc, opcode);
	OFF(ibv_wc, vendor_err);
	OFF(ibv_wc, byte_len);
	OFF(ibv_wc, imm_data);
	OFF(ibv_wc, qp_num);
	OFF(ibv_wc, src_qp);
	OFF(ibv_wc, wc_flags);
	OFF(ibv_wc, pkey_index);
	OFF(ibv_wc, slid);
	OFF(ibv_wc, sl);
	OFF(ibv_wc, dlid_path_bits);

	SZ(ibv_qp_cap);
	OFF(ibv_qp_cap, max_send_wr);
	OFF(ibv_qp_cap, max_recv_wr);
	OFF(ibv_qp_cap, max_send_sge);
	OFF(ibv_qp_cap, max_recv_sge);
	OFF(ibv_qp_cap, max_inline_data);

	SZ(ibv_qp_init_attr);
	OFF(ibv_qp_init_attr, qp_context);
	OFF(ibv_qp_init_attr, send_cq);
	OFF(ibv_qp_init_attr, recv_cq);
	OFF(ibv_qp_init_attr, srq);
	OFF(ibv_qp_init_attr, cap);
	OFF(ibv_qp_init_attr, qp_type);
	OFF(ibv_qp_init_attr, sq_sig_all);

	SZ(ibv_srq_attr);
	SZ(ibv_srq_init_attr);
	OFF(ibv_srq_init_attr, attr);

	SZ(ibv_global_route);
	OFF(ibv_global_route, dgid);
	OFF(ibv_global_route, flow_label);
	OFF(ibv_global_route, sgid_index);
	OFF(ibv_global_route, hop_limit);
	OFF(ibv_global_route, traffic_class);

	SZ(ibv_ah_attr);
	OFF(ibv_ah_attr, grh);
	OFF(ibv_ah_attr, dlid);
	OFF(ibv_ah_attr, sl);
	OFF(ibv_ah_attr, src_path_bits);
	OFF(ibv_ah_attr, static_rate);
	OFF(ibv_ah_attr, is_global);
	OFF(ibv_ah_attr, port_num);

	SZ(ibv_qp_attr);
	OFF(ibv_qp_attr, qp_state);
	OFF(ibv_qp_attr, cur_qp_state);
	OFF(ibv_qp_attr, path_mtu);
	OFF(ibv_qp_attr, path_mig_state);
	OFF(ibv_qp_attr, qkey);
	OFF(ibv_qp_attr, rq_psn);
	OFF(ibv_qp_attr, sq_psn);
	OFF(ibv_qp_attr, dest_qp_num);
	OFF(ibv_qp_attr, qp_access_flags);
	OFF(ibv_qp_attr, cap);
	OFF(ibv_qp_attr, ah_attr);
	OFF(ibv_qp_attr, alt_ah_attr);
	OFF(ibv_qp_attr, pkey_index);
	OFF(ibv_qp_attr, alt_pkey_index);
	OFF(ibv_qp_attr, en_sqd_async_notify);
	OFF(ibv_qp_attr, sq_draining);
	OFF(ibv_qp_attr, max_rd_atomic);
	OFF(ibv_qp_attr, max_dest_rd_atomic);
	OFF(ibv_qp_attr, min_rnr_timer);
	OFF(ibv_qp_attr, port_num);
	OFF(ibv_qp_attr, timeout);
	OFF(ibv_qp_attr, retry_cnt);
	OFF(ibv_qp_attr, rnr_retry);
	OFF(ibv_qp_attr, alt_port_num);
	OFF(ibv_qp_attr, alt_timeout);
	OFF(ibv_qp_attr, rate_limit);

	CONST(IBV_WR_RDMA_WRITE);
	CONST(IBV_WR_RDMA_WRITE_WITH_IMM);
	CONST(IBV_WR_SEND);
	CONST(IBV_WR_SEND_WITH_IMM);
	CONST(IBV_WR_RDMA_READ);
	CONST(IBV_SEND_FENCE);
	CONST(IBV_SEND_SIGNALED);
	CONST(IBV_SEND_SOLICITED);
	CONST(IBV_SEND_INLINE);
	CONST(IBV_WC_SEND);
	CONST(IBV_WC_RDMA_WRITE);
	CONST(IBV_WC_RDMA_READ);
	CONST(IBV_WC_RECV);
	CONST(IBV_WC_RECV_RDMA_WITH_IMM);
	CONST(IBV_WC_WITH_IMM);
	CONST(IBV_WC_SUCCESS);
	CONST(IBV_WC_WR_FLUSH_ERR);
	CONST(IBV_WC_REM_ACCESS_ERR);
	CONST(IBV_WC_GENERAL_ERR);
	CONST(IBV_QPT_RC);
	CONST(IBV_QPS_RESET);
	CONST(IBV_QPS_INIT);
	CONST(IBV_QPS_RTR);
	CONST(IBV_QPS_RTS);
	CONST(IBV_QPS_ERR);
	CONST(IBV_QP_STATE);
	CONST(IBV_QP_CUR_STATE);
	CONST(IBV_QP_ACCESS_FLAGS);
	CONST(IBV_QP_PKEY_INDEX);
	CONST(IBV_QP_PORT);
	CONST(IBV_QP_AV);
	CONST(IBV_QP_PATH_MTU);
	CONST(IBV_QP_TIMEOUT);
	CONST(IBV_QP_RETRY_CNT);
	CONST(IBV_QP_RNR_RETRY);
	CONST(IBV_QP_RQ_PSN);
	CONST(IBV_QP_MAX_QP_RD_ATOMIC);
	CONST(IBV_QP_MIN_RNR_TIMER);
	CONST(IBV_QP_SQ_PSN);
	CONST(IBV_QP_MAX_DEST_RD_ATOMIC);
	CONST(IBV_QP_DEST_QPN);
	CONST(IBV_ACCESS_LOCAL_WRITE);
	CONST(IBV_ACCESS_REMOTE_WRITE);
	CONST(IBV_ACCESS_REMOTE_READ);
	CONST(IBV_ACCESS_REMOTE_ATOMIC);
	CONST(IBV_MTU_256);
	CONST(IBV_MTU_1024);
	CONST(IBV_MTU_4096);
	CONST(IBV_PORT_ACTIVE);
	CONST(IBV_PORT_DOWN);
	CONST(IBV_PORT_ACTIVE_DEFER);
	CONST(IBV_LINK_LAYER_UNSPECIFIED);
	CONST(IBV_LINK_LAYER_INFINIBAND);
	CONST(IBV_LINK_LAYER_ETHERNET);
	return 0;
}
